"""Engine process: synchronous loop, FCFS scheduler, and the router-side EngineClient."""
