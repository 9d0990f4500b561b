"""The pure core: who holds each GPU, who waits, who swaps what.

No I/O and no clock of its own: every input is a call, every decision comes back as
actions, and time is the :class:`~gpushare.core.clock.Clock` it is given. The daemon,
the tests and the policy simulator drive this same code. Checked by the import
contract in ``pyproject.toml`` (no asyncio, sockets, files, threads or time here).
"""
