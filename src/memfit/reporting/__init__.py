"""Tables and pictures of estimates and plans (leaves: nothing in the core imports them)."""
