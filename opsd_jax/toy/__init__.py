"""The toy task and toy model that tests and the tiny CPU configs make for themselves (no
downloads): synthetic ThinkMorph-layout data and a random BAGEL checkpoint in the HF layout."""
