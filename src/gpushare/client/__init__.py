"""The client runtime inside every workload: small and synchronous.

:func:`gpushare.attach` and :class:`~gpushare.client.session.Session`, the swap backends,
and ``gpushare run``'s hooks. Needs only msgspec (and PyTorch where the torch backend or
the hooks are used); never imports the daemon or the tools.
"""
