"""HARP itself: which layers, the plan and its application, what it removes, the prefix cache and the α search, and
how layers are chosen by importance."""
