"""ssh_scheduler: run batches of shell commands across many machines and GPUs over plain SSH."""

__version__ = "0.1.0"
