"""Pure decisions and arithmetic, no I/O: reducer types, recovery plans, fault schedule, XID catalog, reputation, goodput, partitions, timelines."""
