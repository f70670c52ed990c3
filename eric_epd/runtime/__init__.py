"""The skeleton Eric and Geri share: config base, engine loop, scheduler, engine client, executor and workers."""
