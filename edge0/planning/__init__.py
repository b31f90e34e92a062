"""Planning before and after a download: the budget planner behind `edge0 plan` (budget) and the
forecast from config.json and safetensors headers alone (forecast)."""
