"""The ``moecache-ctl`` tools, on top of the daemon core (``moecached``): the dispatcher
(``ctl``), the commands that talk to a running daemon (``ctlstats``, ``metrics``), model
inspection (``inspect``), trace conversion (``tracetools``), the trace simulator
(``simulate``), replay and demo (``replay``, ``demo``, ``workload``), model writers
(``synth``, ``synth_runnable``), the memory guard (``guard``) and the llama.cpp runner
(``engine_llama``). The core never imports from here.
"""
