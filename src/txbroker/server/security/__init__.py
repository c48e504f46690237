"""Who may connect and what they may do: users and password hashes (``auth.py``),
ACLs and the audit log (``acl.py``), and TLS contexts for every listener (``tls.py``).
The operation layer makes the one permission check (``server/ops``); these modules
hold the rules and the material."""
