"""Every rank's machinery: the step it receives, the model runner that runs it, the torchrun launch of ranks."""
