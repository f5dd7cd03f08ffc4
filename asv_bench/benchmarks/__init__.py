"""pscan's asv benchmarks. `PSCAN_ASV_SMOKE=1` keeps only the smallest parameters."""
