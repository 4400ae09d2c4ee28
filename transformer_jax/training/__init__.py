"""Training: the train state, pure step functions, the loop, optimizer and losses."""
