"""The commit protocol: names, manifests, claims, ownership, checkpoints, listing,
deletion, retention and garbage collection."""
