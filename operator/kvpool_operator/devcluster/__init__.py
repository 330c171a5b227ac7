"""A local Kubernetes control plane on loopback for tests and by hand (``kvpool dev-cluster``)."""
