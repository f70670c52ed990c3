"""Eric's generic path: any image-text-to-text checkpoint transformers supports, served at TP 1 by the model's own
vision tower and projector (only their weights read; Gemma 3's and InternVL's workers run models/gemma3.py and
models/internvl.py instead, at any TP) and its own HF processor."""
