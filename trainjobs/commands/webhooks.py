"""``trainjobs webhooks create | list | delete | deliveries``: the caller's signed webhooks.

Through :class:`trainjobs.client.Client`, like the other remote commands; API errors print as
``field: message`` lines. ``create`` prints the signing secret, which the service shows only then.
"""

from __future__ import annotations

import argparse
import sys

from trainjobs.commands.connection import client_for, connection_options, readable_errors


@readable_errors
def cmd_create(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        hook = client.create_webhook(args.target, args.event, args.description)
    print(hook["id"])
    print(f"secret: {hook['secret']}  (shown this once: keep it to verify signatures)", file=sys.stderr)
    return 0


@readable_errors
def cmd_list(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        for hook in client.webhooks():
            state = "enabled" if hook["enabled"] else f"disabled ({hook['disabled_reason']})"
            print(f"{hook['id']}  {state:<8} {hook['url']}  {','.join(hook['events'])}  {hook['description']}")
    return 0


@readable_errors
def cmd_delete(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        client.delete_webhook(args.id)
    print(f"deleted webhook {args.id}", file=sys.stderr)
    return 0


@readable_errors
def cmd_deliveries(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        deliveries = client.webhook_deliveries(args.id, limit=args.limit)
    print(f"{'DELIVERY':<32}  {'EVENT':<18} {'JOB':<32}  {'STATE':<9} {'TRIES':>5}  LAST ATTEMPT")
    for item in deliveries:
        last = item["attempt_log"][-1] if item["attempt_log"] else None
        outcome = "-" if last is None else (f"HTTP {last['status_code']}" if last["status_code"] else last["error"])
        print(f"{item['id']:<32}  {item['event_type']:<18} {item['job_id'] or '-':<32}  {item['state']:<9} "
              f"{item['attempts']:>5}  {outcome}")  # fmt: skip
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    conn = connection_options()
    webhooks = subparsers.add_parser("webhooks", help="signed webhooks for your jobs' events")
    sub = webhooks.add_subparsers(dest="webhooks_command", metavar="ACTION", required=True)
    create = sub.add_parser("create", parents=[conn], help="add a webhook; prints its id, and its secret once")
    # not `url`: that is the service's address (--url)
    create.add_argument("target", metavar="URL", help="the endpoint: an http(s) URL on a public host")
    create.add_argument("--event", action="append", required=True, metavar="TYPE",
                        help="an event type to receive (repeat for more), e.g. job.succeeded")  # fmt: skip
    create.add_argument("--description", default="")
    create.set_defaults(func=cmd_create)
    listing = sub.add_parser("list", parents=[conn], help="your webhooks (an admin's: everyone's)")
    listing.set_defaults(func=cmd_list)
    delete = sub.add_parser("delete", parents=[conn], help="delete a webhook and its deliveries")
    delete.add_argument("id")
    delete.set_defaults(func=cmd_delete)
    deliveries = sub.add_parser("deliveries", parents=[conn], help="a webhook's newest deliveries and their state")
    deliveries.add_argument("id")
    deliveries.add_argument("--limit", type=int, default=20)
    deliveries.set_defaults(func=cmd_deliveries)
