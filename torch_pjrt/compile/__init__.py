"""torch.compile(backend="pjrt"): Dynamo -> AOTAutograd -> one jitted StableHLO program per graph."""
