"""The node's sockets as servers: the workload socket, the admin socket, and the
configuration in force (live settings, the watched file, ``--persist``). Below the
daemon; above everything else in the node."""
