"""The device mesh and its logical-axis rules, multi-host helpers, and the memory a compiled
program needs per device."""
