"""`ember bench`: eager PyTorch, Inductor and ember side by side, against the measured hardware limit.

workloads.py     the programs and their sizes per scale (gpu, cpu, tiny)
measure.py       one step, timing, input rotation, ceilings, peak memory, the limit
compile_time.py  cold and warm compile time in fresh processes
harness.py       the run: every case, every compiler, one process
report.py        JSON lines, tables (rich or plain), markdown, the PNG
__main__.py      the command line (`ember bench`, or `python -m ember.tools.bench`)
"""
