"""Scheduling: which values live in memory, which ops share a kernel, in what order."""
