"""nanochat_cpu: a nanochat-style GPT trainer for a few CPU machines on a LAN."""

__version__ = "0.1.0"
