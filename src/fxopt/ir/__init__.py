"""fxopt's view of a torch.fx graph: canonical ops, aliasing, invariants."""
