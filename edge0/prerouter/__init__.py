"""Pre-router: heads whose prediction is the next token's route, the cross-token stager that reads
those experts while the current token computes, trace collection and training."""
