"""Planning before launch: chip table, memory model, FLOP/MFU accounting, ahead-of-time compilation for TPU
topologies, reading compiled HLO, and the step-time performance model."""
