"""The only place that imports mlx / mlx_lm.

core  array ops and device facts used by core logic (routing, executors, engine)
io    lazy safetensors loading, model construction from a config, tokenizers
quant quantization exactly as `mlx_lm convert -q` does it
nn    the streaming modules that stand in for mlx-lm's expert layers, and forward passes
"""
