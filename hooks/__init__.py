"""Integrations with the training APIs people already use: DDP comm hooks and Horovod."""
