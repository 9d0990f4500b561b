"""The command-line tools people run: ``gpushare`` (cli), ``ctl``, ``top``, ``timeline``,
``demo``, and the simulated workloads. They sit on top of every other layer."""
