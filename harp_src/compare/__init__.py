"""Methods side by side at a matched cost: each point (a HARP variant or a baseline at a parameter budget) built from
the dense model, measured against it (token-level fidelity, task items, speed, KV memory) with every step stored so a
long run resumes, and the paired tables that compare the points."""
