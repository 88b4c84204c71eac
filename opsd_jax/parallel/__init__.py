"""The device mesh and its logical-axis rules, multi-host helpers, and reading compiled programs
for their collectives."""
