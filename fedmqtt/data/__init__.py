"""Site datasets: parsing the bundled files and splitting/normalising each site locally (numpy only)."""
