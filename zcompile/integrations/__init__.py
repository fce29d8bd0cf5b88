"""zcompile inside the training loops people already use (``zcompile.integrations.hf``: Hugging Face
Trainer; ``zcompile.integrations.deepspeed``: a DeepSpeed config read into zcompile's options, also
``zcompile.options_from_deepspeed``). Each integration imports its library only when imported itself
(the DeepSpeed one reads the config as JSON and imports no DeepSpeed)."""
