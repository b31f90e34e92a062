"""Recovery LoRA: unmerged low-rank adapters distilled from the full-precision teacher along the
student's own routing (int4 store, pre-router at serving width K).

adapter.py  the file format (magic name, version, what it was trained for, checksum, provenance)
attach.py   attach_lora(engine, path): checks, then wraps the target linears; the store's adapter choice
distill.py  the teacher, the student's forward along its route, the losses and the optimizer steps
train.py    phase 1 SFT on teacher text, phase 2 on-policy distillation, validation
"""
