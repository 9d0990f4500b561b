"""Where the arbiters' actions go: every input's actions delivered (dispatch) and the
GPUs' timers and gangs ticked (decisions). Imports the guard, what is kept and the host."""
