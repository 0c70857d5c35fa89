"""Frontend: the torch.compile backend entry, AOTAutograd wiring, decompositions, ATen import."""
