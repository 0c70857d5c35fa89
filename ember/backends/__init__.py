"""Backends: per device, the toolchain stages from generated source to something callable."""
