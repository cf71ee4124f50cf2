"""harp-trt: export and compile HARP-pruned LLMs (calibrate -> rewrite -> build -> bench)."""
__version__ = "0.1.0"
