"""Code generation: kernel source per target language, and the host program."""
