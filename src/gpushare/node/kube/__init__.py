"""The node in Kubernetes: pod names from the API, and the node's ``GPUShareNode``
object (its status body, the API it is written through, the reconciler that writes it
and applies its spec). Imports only what is kept and the host."""
