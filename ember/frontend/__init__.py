"""The entry floor: the torch.compile backend, AOTAutograd wiring and its cache, decompositions, and
the attention rewrite that runs on Dynamo's graph before AOTAutograd."""
