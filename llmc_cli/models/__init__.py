"""The model families (GPT-2, Llama 3): configs, parameter tables, activation plans, and forward/backward
written as straight-line calls into the kernel contract."""
