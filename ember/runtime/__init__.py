"""Runtime support: the disk cache (the host program itself is generated, see codegen/host.py)."""
