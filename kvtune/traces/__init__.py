"""Production traffic without its text: traces of arrival times, token counts and chained block hashes.

A trace says which requests share which prefixes and when they arrive; that is what decides a prefix cache's
hit rate and a pool's size. This folder reads and writes traces (`format`), selects and rescales them
(`window`), turns their blocks into token-id prompts an engine can serve (`tokens`) and computes the hit
rate of every pool size in one pass (`curve`), with no I/O beyond the trace file itself.
"""
