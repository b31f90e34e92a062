"""One model across several machines with MLX's distributed runtime: each rank runs a contiguous
range of layers (a pipeline stage) and streams only its own layers' experts; rank 0 runs the last
stage, samples and returns text, the other ranks follow it.

split.py     which layers each rank runs (balanced by bytes, or --pipeline-split)
pipeline.py  the stage exchange (hidden states, token ids, pre-router logits, statistics) and the
             follower loop
setup.py     joining the ranks at load: the group, agreement on store, split and serving options
"""
