/* ECE through ferroce's drop-in libraries, as a C program sees it (tests/dropin.rs runs it).
 *
 *   ece query                     a new QP's ECE, and what ibv_set_ece refuses
 *   ece server PORT [nodata]      rdma_cm on 127.0.0.1:PORT (or $ECE_BIND:PORT): the
 *                                 request's ECE, accept, the ECE in force, then one SEND
 *                                 received (unless nodata)
 *   ece client ADDR PORT [nodata] rdma_cm to ADDR:PORT: the offer, connect, the ECE in force,
 *                                 then one SEND (unless nodata)
 *
 * Each result is a line "key value...", which the test reads; failures go to stderr with a
 * non-zero exit. */
#include <arpa/inet.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

static void die(const char *what)
{
	fprintf(stderr, "%s failed: %s\n", what, strerror(errno));
	exit(1);
}

static void print_ece(const char *key, int rc, const struct ibv_ece *e)
{
	if (rc)
		printf("%s error %d\n", key, errno);
	else
		printf("%s 0x%x 0x%x %u\n", key, e->vendor_id, e->options, e->comp_mask);
	fflush(stdout);
}

static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want)
{
	struct rdma_cm_event *ev;

	if (rdma_get_cm_event(ch, &ev))
		die("rdma_get_cm_event");
	if (ev->event != want) {
		fprintf(stderr, "got %s (status %d), wanted %s\n", rdma_event_str(ev->event),
			ev->status, rdma_event_str(want));
		exit(1);
	}
	return ev;
}

static void wait_cq(struct ibv_cq *cq, const char *what)
{
	struct ibv_wc wc;
	time_t until = time(NULL) + 10;
	int n;

	do {
		n = ibv_poll_cq(cq, 1, &wc);
	} while (n == 0 && time(NULL) < until);
	if (n != 1 || wc.status != IBV_WC_SUCCESS) {
		fprintf(stderr, "%s: %d completions, status %s\n", what, n,
			n == 1 ? ibv_wc_status_str(wc.status) : "-");
		exit(1);
	}
}

static int query(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	struct ibv_device *dev = NULL;
	struct ibv_ece e, bad, none, ours;
	int rc;

	for (int i = 0; list && list[i]; i++)
		if (!strcmp(ibv_get_device_name(list[i]), "ferroce_lo"))
			dev = list[i];
	if (!dev)
		die("finding ferroce_lo");
	struct ibv_context *ctx = ibv_open_device(dev);
	if (!ctx)
		die("ibv_open_device");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_qp_init_attr init = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = pd && cq ? ibv_create_qp(pd, &init) : NULL;
	if (!qp)
		die("ibv_create_qp");

	memset(&e, 0xff, sizeof(e));
	rc = ibv_query_ece(qp, &e);
	print_ece("offer", rc, &e);
	bad = (struct ibv_ece){ .vendor_id = e.vendor_id, .options = 1, .comp_mask = 1 };
	errno = 0;
	rc = ibv_set_ece(qp, &bad);
	printf("set_comp_mask %d %d\n", rc, errno);
	none = (struct ibv_ece){ .vendor_id = 0, .options = 1 };
	errno = 0;
	rc = ibv_set_ece(qp, &none);
	printf("set_vendor_0 %d %d\n", rc, errno);
	ours = (struct ibv_ece){ .vendor_id = e.vendor_id, .options = 1 };
	rc = ibv_set_ece(qp, &ours);
	printf("set_ours %d\n", rc);

	ibv_destroy_qp(qp);
	ibv_destroy_cq(cq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	printf("end 0\n");
	return 0;
}

static struct ibv_qp_init_attr qp_attr(void)
{
	struct ibv_qp_init_attr a = {
		.qp_type = IBV_QPT_RC,
		.sq_sig_all = 1,
		.cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1 },
	};
	return a;
}

static struct rdma_conn_param conn_param(void)
{
	struct rdma_conn_param p = {
		.responder_resources = 1, .initiator_depth = 1, .retry_count = 7, .rnr_retry_count = 7,
	};
	return p;
}

static int server(int port, int data)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *listen_id, *id;
	struct rdma_cm_event *ev;
	struct ibv_ece e = { 0 }, mine = { .vendor_id = 0x46524345, .options = 1 };
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	char buf[64] = { 0 };
	int rc;

	a.sin_addr.s_addr = inet_addr(getenv("ECE_BIND") ? getenv("ECE_BIND") : "127.0.0.1");
	if (!ch || rdma_create_id(ch, &listen_id, NULL, RDMA_PS_TCP))
		die("rdma_create_id");
	if (rdma_bind_addr(listen_id, (struct sockaddr *)&a) || rdma_listen(listen_id, 1))
		die("rdma_bind_addr/rdma_listen");
	ev = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
	id = ev->id;
	rdma_ack_cm_event(ev);

	/* The request's ECE, read before the QP is made (librdmacm's rule). */
	rc = rdma_get_remote_ece(id, &e);
	print_ece("remote_ece", rc, &e);
	struct ibv_qp_init_attr attr = qp_attr();
	if (rdma_create_qp(id, NULL, &attr))
		die("rdma_create_qp");
	errno = 0;
	rc = rdma_get_remote_ece(id, &e);
	printf("remote_ece_with_qp %d %d\n", rc, errno);
	errno = 0;
	rc = rdma_set_local_ece(id, &mine);
	printf("local_ece_with_qp %d %d\n", rc, errno);

	struct ibv_mr *mr = ibv_reg_mr(id->pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		die("ibv_reg_mr");
	if (data) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = sizeof(buf), .lkey = mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = 1, .sg_list = &sge, .num_sge = 1 }, *bad;
		if (ibv_post_recv(id->qp, &wr, &bad))
			die("ibv_post_recv");
	}
	struct rdma_conn_param p = conn_param();
	if (rdma_accept(id, &p))
		die("rdma_accept");
	ev = expect(ch, RDMA_CM_EVENT_ESTABLISHED);
	rdma_ack_cm_event(ev);
	rc = ibv_query_ece(id->qp, &e);
	print_ece("in_force", rc, &e);
	if (data) {
		wait_cq(id->recv_cq, "receive");
		printf("received %s\n", buf);
	}
	fflush(stdout);
	ev = expect(ch, RDMA_CM_EVENT_DISCONNECTED);
	rdma_ack_cm_event(ev);

	ibv_dereg_mr(mr);
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
	rdma_destroy_id(listen_id);
	rdma_destroy_event_channel(ch);
	printf("end 0\n");
	return 0;
}

static int client(const char *addr, int port, int data)
{
	struct rdma_event_channel *ch = rdma_create_event_channel();
	struct rdma_cm_id *id;
	struct rdma_cm_event *ev;
	struct ibv_ece e;
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	char buf[64] = "hello";
	int rc;

	a.sin_addr.s_addr = inet_addr(addr);
	if (!ch || rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
		die("rdma_create_id");
	if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&a, 2000))
		die("rdma_resolve_addr");
	rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED));
	if (rdma_resolve_route(id, 2000))
		die("rdma_resolve_route");
	rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED));

	/* librdmacm's checks; a valid ECE without a QP is taken (and replaced by the QP's). */
	e = (struct ibv_ece){ .vendor_id = 0, .options = 1 };
	errno = 0;
	rc = rdma_set_local_ece(id, &e);
	printf("local_ece_vendor_0 %d %d\n", rc, errno);
	e = (struct ibv_ece){ .vendor_id = 0x46524345, .options = 1, .comp_mask = 1 };
	errno = 0;
	rc = rdma_set_local_ece(id, &e);
	printf("local_ece_comp_mask %d %d\n", rc, errno);
	e = (struct ibv_ece){ .vendor_id = 0x46524345, .options = 0 };
	rc = rdma_set_local_ece(id, &e);
	printf("local_ece %d\n", rc);

	struct ibv_qp_init_attr attr = qp_attr();
	if (rdma_create_qp(id, NULL, &attr))
		die("rdma_create_qp");
	rc = ibv_query_ece(id->qp, &e);
	print_ece("offer", rc, &e);
	struct ibv_mr *mr = ibv_reg_mr(id->pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		die("ibv_reg_mr");
	struct rdma_conn_param p = conn_param();
	if (rdma_connect(id, &p))
		die("rdma_connect");
	rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ESTABLISHED));
	rc = ibv_query_ece(id->qp, &e);
	print_ece("in_force", rc, &e);
	if (data) {
		struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 6, .lkey = mr->lkey };
		struct ibv_send_wr wr = { .wr_id = 2, .sg_list = &sge, .num_sge = 1,
					  .opcode = IBV_WR_SEND }, *bad;
		if (ibv_post_send(id->qp, &wr, &bad))
			die("ibv_post_send");
		wait_cq(id->send_cq, "send");
		printf("sent %s\n", buf);
	}
	fflush(stdout);
	if (rdma_disconnect(id))
		die("rdma_disconnect");
	rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_DISCONNECTED));

	ibv_dereg_mr(mr);
	rdma_destroy_qp(id);
	rdma_destroy_id(id);
	rdma_destroy_event_channel(ch);
	printf("end 0\n");
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc == 2 && !strcmp(argv[1], "query"))
		return query();
	if (argc >= 3 && !strcmp(argv[1], "server"))
		return server(atoi(argv[2]), !(argc > 3 && !strcmp(argv[3], "nodata")));
	if (argc >= 4 && !strcmp(argv[1], "client"))
		return client(argv[2], atoi(argv[3]), !(argc > 4 && !strcmp(argv[4], "nodata")));
	fprintf(stderr, "usage: ece query | server PORT [nodata] | client ADDR PORT [nodata]\n");
	return 2;
}
