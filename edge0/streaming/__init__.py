"""Executors: how a MoE layer gets the tensors of the experts its route selects."""
