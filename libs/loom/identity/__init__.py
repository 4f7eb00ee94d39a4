"""Who may do what: REST tokens and tenants, NATS users and their permissions, and the directories a client may
name files in."""
