"""What the experiments share: the baselines every experiment compares (`baselines`), the live
runs on a real server (`live`), the co-simulation of transport and router (`cosim`), and the
tables, CSVs and plots they write (`output`). Each experiment module reproduces or extends one
figure or table; nothing here is one."""
