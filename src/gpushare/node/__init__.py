"""The node daemon (``gpushare node``): one asyncio process per machine.

It moves messages and state in and out of the core's arbiters and decides nothing
itself: sockets in, actions out. Never imported by a workload.
"""
