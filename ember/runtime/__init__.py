"""Runtime support: the cache layer (cache.py: the key of everything ember caches, and the disk
cache; schedule_cache.py: a graph's schedule as a cache entry), a private folder for files that must
be loaded from a path (scratch.py), and huge pages for large CPU buffers. The host program that
runs a graph is generated (codegen/host.py)."""
