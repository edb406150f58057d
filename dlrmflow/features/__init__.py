"""Features stage: the feature spec and the transform from Arrow record batches to tensors."""
