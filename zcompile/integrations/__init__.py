"""zcompile inside the training loops people already use (``zcompile.integrations.hf``: Hugging Face
Trainer). Each integration imports its library only when imported itself."""
