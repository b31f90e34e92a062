"""Pre-router: heads whose prediction is the next token's route, the cross-token stager that reads
those experts while the current token computes, trace collection and training.

heads.py   the heads file format (magic name, version, the store it was trained for)
routes.py  PreRouting: predicted routes for the MoE blocks, teacher forcing
stager.py  the engine's StepHooks: reads the predicted experts ahead, swaps them in at the boundary
attach.py  which heads file to serve, and attaching it to an engine
train.py   trace collection, the head loss and its training loop, held-out recall
"""
