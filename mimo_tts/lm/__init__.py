"""Stage-0: the MiMo-Audio LM (Qwen2 backbone + patch encoder + patch decoder) and generation."""
